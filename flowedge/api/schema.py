"""OpenAI request bodies (validated by pydantic) and the answers built from a flowedge result.

Only what flowedge can honour is accepted: one choice (`n` = 1), text content (a list of text parts
is joined), sampling by temperature/top_p/seed (and top_k, an extension), stop strings. A field that
would change the answer and that flowedge cannot honour (`tools`, `response_format`, `logprobs`,
non-zero penalties, ...) is refused, naming it, rather than silently ignored; fields that do not change
the answer (`user`, `stream_options` without usage, ...) are ignored. `strategy` (an extension, e.g.
`extra_body={"strategy": "ar-pp"}`) picks the head's strategy.

Types are strict, as JSON has them: `"stream": "yes"` is not a bool, `true` is not a token id or a
count (pydantic's lax mode would take both); an int is still a number.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_STOPS = 16
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for a text completion's max_tokens
STRICT = ConfigDict(strict=True)
# Fields an OpenAI client may send that flowedge cannot honour, each refused when it asks for something
# (a value other than its "off" one: None, False, 0, an empty list or map).
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
               "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "best_of",
               "suffix", "audio", "modalities", "prediction",
               # other servers' sampling extensions (vLLM, llama.cpp) that flowedge's sampler does not have
               "min_p", "repetition_penalty", "typical_p", "tfs_z", "mirostat", "top_a")
# their "off" value where it is not 0 (a penalty or a mass of 1 changes nothing)
OFF_AT_ONE = ("repetition_penalty", "typical_p", "tfs_z", "best_of")


def unsupported(field: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"`{field}` is not supported by flowedge; leave it out")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        """One readable message for content flowedge cannot read (an image, audio, a file, a number),
        instead of pydantic's attempt at each member of the union."""
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "input_image", "image"):
                    raise PydanticCustomError("content", "image content parts are not supported; send text")
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError("content", "{kind} content parts are not supported; send text",
                                              {"kind": kind})
        elif not isinstance(v, str):
            raise PydanticCustomError("content", "must be a string or a list of text parts")
        return v

    def turn(self) -> dict[str, str]:
        """The {role, content} turn the head's chat template gets (developer = system)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Sampling(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str = ""
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)   # an extension (as vLLM and llama.cpp have it); 0: off
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    strategy: str = Field("", max_length=64)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise PydanticCustomError("unsupported", "flowedge answers with one choice: `n` must be 1")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data):
        """The first unsupported field that asks for something, as an error located at that field."""
        if isinstance(data, dict):
            for field in UNSUPPORTED:
                value = data.get(field)
                if value not in (None, False, 0, [], {}) and not (field in OFF_AT_ONE and value == 1):
                    raise ValidationError.from_exception_data(cls.__name__, [
                        {"type": unsupported(field), "loc": (field,), "input": value}])
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or ())
        if len(stops) > MAX_STOPS or not all(0 < len(s) <= 256 for s in stops):
            raise ValueError(f"at most {MAX_STOPS} non-empty stop strings of <= 256 characters")
        return stops

    def client_kwargs(self, default_max_tokens: int) -> dict:
        return dict(max_new_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                    top_k=self.top_k or None, top_p=self.top_p, seed=self.seed, stop=self.stop or [],
                    strategy=self.strategy)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)

    def client_kwargs(self, default_max_tokens: int) -> dict:
        kwargs = super().client_kwargs(default_max_tokens)
        if self.max_completion_tokens is not None:
            kwargs["max_new_tokens"] = self.max_completion_tokens
        return {**kwargs, "messages": [m.turn() for m in self.messages]}


class CompletionRequest(Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=1, le=1 << 20)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        """A string, a list of one string, or token ids; one message for every other shape."""
        if isinstance(v, list) and v and all(isinstance(s, str) for s in v):
            if len(v) != 1:
                raise ValueError("one prompt per request (batch several requests instead)")
            v = v[0]
        if v == "" or v == []:
            raise ValueError("the prompt is empty")
        if not isinstance(v, str) and not (isinstance(v, list) and all(type(t) is int for t in v)):
            raise ValueError("a string, or a list of token ids (integers)")
        return v

    def client_kwargs(self, default_max_tokens: int) -> dict:
        kwargs = super().client_kwargs(COMPLETION_MAX_TOKENS)   # an explicit null means OpenAI's default too
        if isinstance(self.prompt, str):
            return {**kwargs, "prompt": self.prompt, "raw": True}
        return {**kwargs, "prompt": list(self.prompt)}


# ---------------------------------------------------------------- answers
class Reply:
    """One answer's identity (id, creation time, model) and the objects built for it."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, result: dict, prefix: str = "") -> dict:
        text, reason = prefix + result.get("text", ""), result.get("finish_reason", "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(result), "flowedge": stats(result)}

    def chunk(self, text: str | None, reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}

    def usage_chunk(self, result: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(result)}


def usage(result: dict) -> dict:
    prompt, new = int(result.get("prompt_tokens", 0)), int(result.get("new_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


def stats(result: dict) -> dict:
    """flowedge's own figures about the answer (an extra field OpenAI clients ignore)."""
    keys = ("strategy", "tokens_per_s", "wall_s", "mean_accept_len", "steps", "rounds", "first_token_s")
    return {k: result[k] for k in keys if k in result}
