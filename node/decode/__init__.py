"""One answer's decoding: the prompt from a template (render), the decode loop (loop), its
prefill steps (prefill), the text the client sees (text), sampling and penalties (sampling),
grammars (grammar), reasoning markers (reasoning), a chat answer into its parts (parts)."""
