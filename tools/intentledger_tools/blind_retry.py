"""The broken build the chaos harness must catch (`intentledger chaos --mutation
blind-retry`): the normal worker command, whose reconciler resends an operation
it is about to check (an UNKNOWN one) with a fresh key and records nothing, as a
timer-driven retry would. Every such resend the provider executes is a second
charge the judge has to find.

It lives in the tools, not behind a setting of the service, so that no shipped
build can be switched into double-charging.

    python -m intentledger_tools.blind_retry worker [options of `intentledger worker`]
"""

from __future__ import annotations

from unittest.mock import patch

from intentledger import service
from intentledger.cli import app
from intentledger.engine.reconciler import Reconciler
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.store.records import OperationRecord, OutboxRecord


class BlindRetryReconciler(Reconciler):
    async def _begin_check(
        self, row: OutboxRecord
    ) -> tuple[OperationRecord, ProviderLookup] | None:
        begun = await super()._begin_check(row)
        if begun is not None:
            operation, _ = begun
            body = {k: v for k, v in operation.request_context["body"].items() if k != "mandate_id"}
            await self.provider.submit(
                ProviderRequest(
                    operation.kind, operation.operation_id, f"{operation.operation_id}:blind", body
                )
            )
        return begun


def main() -> None:
    # build_worker names the class it builds through the service module.
    with patch.object(service, "Reconciler", BlindRetryReconciler):
        app()


if __name__ == "__main__":
    main()
