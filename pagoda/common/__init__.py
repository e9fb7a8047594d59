"""Code both processes import: step-protocol framing, ZeroMQ transport, CurveZMQ, systemd
notification, the flags > environment > TOML settings loader and the default endpoints.

Imports neither torch nor grpc.
"""
