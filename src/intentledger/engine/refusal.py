"""A request the business rules do not allow; raised inside the intake
transaction, so nothing is written for it and its key stays unused."""

from __future__ import annotations


class Refusal(Exception):
    def __init__(self, status: int, slug: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.detail = detail
