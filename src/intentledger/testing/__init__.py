"""What a provider adapter's own tests run to show it keeps the port's promises
(`intentledger.testing.conformance`)."""
