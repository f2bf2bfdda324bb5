"""intentledger: durable idempotent payment intents that stay honest about unknown outcomes."""
