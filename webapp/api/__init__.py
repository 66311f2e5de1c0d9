"""Other tools' way in: an OpenAI-compatible API over the loaded engine (`openai.py`, `/v1`)."""
