"""Generated code for ``kvbeam.v1``: ``kvbeam_pb2`` (messages) and ``kvbeam_pb2_grpc`` (service).

Do not edit the ``kvbeam_pb2*`` files; regenerate them with ``proto/generate.sh``.
"""
