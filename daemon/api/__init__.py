"""The user's side: the meshd command, the local gRPC API, its client and renderings."""
