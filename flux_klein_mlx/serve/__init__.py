"""The `serve` command: an OpenAI-style HTTP API and a web page over one pipeline. Nothing but
`__main__` imports this wing; it imports no command module."""
