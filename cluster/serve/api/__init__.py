"""`serve`'s API dialects: what they share, OpenAI's chat completions and completions, OpenAI's
Responses, Anthropic's Messages.
"""
