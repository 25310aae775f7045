"""Generated gRPC stubs of the specmesh.v1 protocol."""
