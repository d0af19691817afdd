"""OpenAI's WebRTC endpoints: client secrets, calls, and a call's audio and data channel."""
