"""The ways the server's client can send new camera frames (remote.frame_transport): named here,
where both the client and the node's parameter table read them, so neither imports the other.
What each one does is the parameter's description (settings.py) and the client's docstring."""

FRAME_TRANSPORTS = ("auto", "shm", "resized")
