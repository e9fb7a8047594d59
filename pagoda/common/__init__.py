"""Code both processes import: the step schema and its codec, step-protocol framing, ZeroMQ
transport, CurveZMQ, systemd notification, the flags > environment > TOML settings loader and
the default endpoints.

Imports neither torch nor grpc.
"""
