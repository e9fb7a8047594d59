"""pagoda-openai: the OpenAI-compatible HTTP front, a separate process and a client of the
scheduler's public gRPC API. It translates and decides nothing: every field it honours
exists in pagoda.v1 first, and what does not yet is refused with a 400 naming it."""
