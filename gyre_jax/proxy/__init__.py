"""The OpenAI- and Anthropic-compatible proxy: chat templates, token-in/token-out prompts, routing and TITO records."""
