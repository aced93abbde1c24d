"""How frames travel between nodes: the gRPC links (`links`), the TLS lanes beside them
(`lanes`) and the conversions between frames and stage events (`frames`). Imports only the
shared modules of meshd.inference."""
