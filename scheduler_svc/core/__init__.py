"""The scheduling core: pure, no I/O (no grpc, zmq, asyncio, protobuf or torch)."""
