"""The ``kvbeam.v1`` control-plane protocol: protobuf messages, gRPC service, codecs.

- :mod:`kvbeam.proto.kvbeam.v1` holds the generated code (``kvbeam_pb2``,
  ``kvbeam_pb2_grpc``); regenerate it with ``proto/generate.sh``.
- :mod:`kvbeam.proto.version`: :data:`~kvbeam.proto.version.PROTOCOL_VERSION`.
- :mod:`kvbeam.proto.layout_codec`, :mod:`kvbeam.proto.endpoint_codec`,
  :mod:`kvbeam.proto.side`, :mod:`kvbeam.proto.differences`: strict conversions
  between the Python values and the messages.
- :mod:`kvbeam.proto.errors`: :class:`~kvbeam.proto.errors.ProtocolError`.
"""
