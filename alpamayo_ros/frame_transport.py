"""The ways the server's client can send new camera frames (remote.frame_transport).

Named in a module of its own, outside serve/, so the node's parameter table (settings.py) can
offer the choices without depending on the server package, and the client reads the same tuple.
What each one does is the parameter's description (settings.py) and the client's docstring.
"""

FRAME_TRANSPORTS = ("auto", "shm", "resized")
