"""The server: HTTP and WebSocket on one port, admission, metrics, and the asyncio shell that
runs one session per connection."""
