"""One realtime session, sans-I/O: client events in, server events and actions out; its
conversation, responses, input audio and turn taking, and the backend it asks for turns."""
