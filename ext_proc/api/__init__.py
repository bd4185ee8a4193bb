"""The client APIs: one module per API family (OpenAI chat and completions, Anthropic
Messages, OpenAI Responses), each behind `routes.ClientApi`. An API parses its client's
body into the pipeline request the gateway plans on, chooses how its answer is made from the
pipeline's (`protocol.Conversion`, per-step derender) and owns its error envelope; the route
table (`routes.py`) maps a route's handler to its API. Below this room only the two
pipelines (chat, completions) exist."""
