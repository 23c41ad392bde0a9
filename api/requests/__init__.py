"""Request parsing: JSON bodies to a prompt plus SamplingParams, every field validated (a 400
naming it) before anything reaches the engine; the field table the OpenAPI document is
built from."""
