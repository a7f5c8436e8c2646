"""The one budget every method obeys: the most KV rows one layer's KV head may hold on the device tier.

A budget is given either as a row count (``512``) or as a fraction of the prompt (``0.1``); a fraction is
resolved to rows once the prompt length is known, at prefill, and stays fixed while decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zoomkv.errors import BudgetError


@dataclass(frozen=True)
class Budget:
    """The budget B: device rows per layer per KV head, as a row count (``Budget(rows=512)``) or as a share
    of the prompt resolved once its length is known (``Budget(fraction=0.1)``); ``parse`` reads the
    command line's form (``"512"``, ``"0.1"``)."""

    rows: int | None = None  # absolute row count
    fraction: float | None = None  # fraction of the prompt length

    def __post_init__(self) -> None:
        if (self.rows is None) == (self.fraction is None):
            raise BudgetError("a budget is either a row count or a fraction of the context, not both")
        if self.rows is not None and self.rows < 1:
            raise BudgetError(f"budget must be at least 1 row, got {self.rows}")
        if self.fraction is not None and not (0.0 < self.fraction <= 1.0):
            raise BudgetError(f"a fractional budget must lie in (0, 1], got {self.fraction}")

    @classmethod
    def parse(cls, value: str | int | float | Budget | None, *, max_rows: int | None = None) -> Budget | None:
        """``"512"``/``512`` → 512 rows; ``"0.1"``/``0.1`` → 10% of the prompt; ``None`` → no budget.

        ``max_rows`` (the model's context limit) rejects budgets no prompt could ever need.
        """
        if value is None or isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise BudgetError(f"budget must be a number, got {value!r}")
        if isinstance(value, str):
            text = value.strip()
            try:
                number: float | int = int(text)
            except ValueError:
                try:
                    number = float(text)
                except ValueError:
                    raise BudgetError(
                        f"budget must be a row count (e.g. 512) or a fraction of the context (e.g. 0.1), got {value!r}"
                    ) from None
        else:
            number = value
        if isinstance(number, float) and not math.isfinite(number):
            raise BudgetError(f"budget must be finite, got {value!r}")
        if number <= 0:
            raise BudgetError(f"budget must be positive, got {value!r}")
        if isinstance(number, float) and number.is_integer() and number > 1:
            number = int(number)
        if isinstance(number, float):
            if number > 1:
                raise BudgetError(f"a fractional budget must be at most 1.0, got {value!r}")
            return cls(fraction=number)
        return cls(rows=int(number)).check_fits(max_rows)

    def check_fits(self, max_rows: int | None) -> Budget:
        """Refuse a row count over ``max_rows`` (the model's longest context): no prompt could ever need it."""
        if max_rows is not None and self.rows is not None and self.rows > max_rows:
            raise BudgetError(f"budget {self.rows} rows exceeds the model's maximum context of {max_rows} tokens")
        return self

    def resolve(self, context_length: int) -> int:
        """Rows per layer per KV head for a prompt of ``context_length`` tokens."""
        if self.rows is not None:
            return self.rows
        assert self.fraction is not None
        return max(1, math.ceil(self.fraction * context_length))

    def __str__(self) -> str:
        return str(self.rows) if self.rows is not None else f"{self.fraction:g}"
