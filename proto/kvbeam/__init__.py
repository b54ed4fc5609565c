"""Generated protobuf/gRPC code of the ``kvbeam.v1`` protocol package (see proto/generate.sh)."""
