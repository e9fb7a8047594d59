"""Code both processes import: the step schema and its codec, step-protocol framing, ZeroMQ
transport, CurveZMQ, systemd notification, the flags > environment > TOML settings loader,
the default endpoints and the log format.

Imports neither torch nor grpc.
"""
