from collections.abc import Callable
from typing import Any

ABI: int

def canonical(value: object, max_depth: int, max_bytes: int = -1, /) -> bytes | bool | None: ...
def string(text: str, /) -> bytes | None: ...

class RequestInit:
    def __init__(
        self, cls: type, py_init: Callable[..., None], default_agent: str, max_name: int, /
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> None: ...
    __wrapped__: Callable[..., None]
