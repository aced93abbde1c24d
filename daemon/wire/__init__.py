"""Generated protobuf/gRPC modules for proto/meshd.proto (see gen.py)."""

from . import meshd_pb2 as pb
from . import meshd_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
