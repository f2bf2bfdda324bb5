"""What the two HTTP entry points share, below both of them.

The API (api/) and the operator console (console/) are siblings mounted by one
composition root (intentledger/app.py); neither imports the other. The pieces
both need — the principal a bearer token names, problem+json responses, the
Idempotency-Key check and the operator actions' bodies — live here, and read
and write only through the engine.
"""
