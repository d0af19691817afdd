"""The speech stages: speech to text, voice activity, turn ends, text to speech."""
