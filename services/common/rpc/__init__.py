"""The wire contract as Python: stubs generated from `proto/` (committed; regenerate with
`python -m services.common.rpc.generate`) and the one place proto <-> core conversions live
(`convert.py`).

    from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
"""
