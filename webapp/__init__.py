"""flashcode's web app and command line. The engines live in `engine/` and know nothing of this."""
