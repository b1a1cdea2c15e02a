"""The declared fields of the request models, as JSON paths: `stream_options.include_usage`,
`tools[].function.name`, `response_format.json_schema.schema` (aliases, as a client writes them). Nested models
are walked through Optional, unions, lists and Annotated."""

from __future__ import annotations

import typing
from collections.abc import Iterator

from pydantic import BaseModel


def declared_fields(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        yield path
        for sub, is_list in _nested_models(field.annotation):
            yield from declared_fields(sub, path + ("[]." if is_list else "."))


def _nested_models(annotation, in_list: bool = False) -> Iterator[tuple[type[BaseModel], bool]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, in_list
        return
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from _nested_models(args[0], in_list)
    elif origin in (list, tuple, set):
        for arg in args:
            yield from _nested_models(arg, True)
    elif args and origin is not dict and origin is not typing.Literal:
        for arg in args:  # unions (X | None, Literal[...] | Model)
            yield from _nested_models(arg, in_list)
