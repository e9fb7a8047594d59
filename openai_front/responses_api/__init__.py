"""OpenAI's Responses API (POST /v1/responses), its stateless part: one more translation
onto the gRPC Chat call, beside chat completions.

The body (`schema`) becomes one Chat call (`translation`): input items are chat messages,
function tools and calls are the Chat's own, text.format is the constraint. Its chunks
become the response object (`output`), whole or as the API's typed stream events
(`events`). Nothing is stored: a field that needs a stored response, conversation or
prompt is refused by name.
"""
