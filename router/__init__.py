"""pagoda-router: one gRPC address in front of several scheduler replicas, each request
sent where its prompt's prefix is most likely cached (docs/operations.md, "Replicas")."""
