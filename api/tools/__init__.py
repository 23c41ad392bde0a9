"""Tool calls in answers: reading them out of generated text (parser.py: Hermes; forced.py: a
forced call the grammar shaped) and writing them into chat messages and stream deltas
(answers.py). The request side (the tools field, tool_choice, the grammar) is
api/requests/tools.py."""
