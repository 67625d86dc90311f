"""The contracts shared by router and workers: the gRPC API and the block hash."""
