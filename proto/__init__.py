"""The ``kvbeam.v1`` control-plane protocol: protobuf messages, gRPC service, codecs.

- :mod:`kvbeam.proto.kvbeam.v1` holds the generated code (``kvbeam_pb2``,
  ``kvbeam_pb2_grpc``); regenerate it with ``proto/generate.sh``.
- :mod:`kvbeam.proto.version`: :data:`~kvbeam.proto.version.PROTOCOL_VERSION` and
  :data:`~kvbeam.proto.version.SERVICE_NAME`.
- :mod:`kvbeam.proto.layout_codec`, :mod:`kvbeam.proto.endpoint_codec`,
  :mod:`kvbeam.proto.side`, :mod:`kvbeam.proto.differences`,
  :mod:`kvbeam.proto.transfer_codec`, :mod:`kvbeam.proto.rejection_codec`: strict
  conversions between the Python values and the messages (and the handshake
  rejection trailer).

A message kvbeam refuses raises :class:`kvbeam.errors.ProtocolError`. This package
never imports the daemons' package (tests/unit/test_import_boundary.py checks).
"""
