"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), Triton's extensions included.

``codec`` turns protobuf messages (``edged.protocol.grpc.gen``) into the shared v2 codec's requests
and back, ``app`` answers each RPC through the one inference service, ``server`` owns the listener.
grpcio and protobuf come with the ``grpc`` extra and are imported only when ``[grpc]`` is configured.
"""
