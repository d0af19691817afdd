"""The Realtime protocol's shapes: client and server events, the values they hold, the session's
settings and how `session.update` changes them. No I/O."""
