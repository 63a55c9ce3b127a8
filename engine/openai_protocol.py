"""Request and response bodies of the worker's HTTP API (pydantic v2).

Requests: ``ChatCompletionRequest`` (/v1/chat/completions),
``CompletionRequest`` (/v1/completions), ``GenerateReqInput`` (/generate,
SGLang-compatible), ``AbortRequest`` (/abort_request).

Rules:
* The models check *shape and type* only (a wrong type or a missing field
  becomes a 422).  Value ranges that depend on the model or the server
  (context length, vocabulary, limits) are checked by the serving code and
  become a 400 with the offending ``param`` named.
* Booleans and strings are strict (``"yes"`` is not a bool, ``1`` is not a
  string); numbers accept ints where floats are expected.
* Unknown top-level fields are ignored, as OpenAI-compatible servers do;
  unknown keys inside ``/generate``'s ``sampling_params`` are rejected.

Non-streamed responses are built as the response models below and
serialised with ``model_dump()``; streamed chunks follow the same field
names (``docs/api.md``) and are written as plain dicts.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_serializer

# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextContentPart], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[StrictStr] = None


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI): the schema is kept as given and compiled by the grammar backend."""

    model_config = ConfigDict(populate_by_name=True)
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(BaseModel):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: StrictStr
    json_schema: Optional[JsonSchemaFormat] = None


class ResumeInfo(BaseModel):
    """``kvship_resume``, sent only by the router: this request continues a broken stream; its last
    ``output_tokens`` prompt ids are earlier output, of whose text the client has ``relayed_chars``
    characters (io_struct.Resumed; docs/router.md, "Resuming broken streams")."""

    model_config = ConfigDict(extra="forbid")
    output_tokens: StrictInt
    relayed_chars: StrictInt


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions (OpenAI names plus the usual extras)."""

    model: Optional[StrictStr] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: Optional[StrictInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[StrictStr] = None
    # extras (vLLM / SGLang)
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[StrictInt]] = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    rid: Optional[StrictStr] = None
    # PD disaggregation (filled in by the router; choice i of n uses room bootstrap_room + i)
    bootstrap_host: Optional[StrictStr] = None
    bootstrap_port: Optional[StrictInt] = None
    bootstrap_room: Optional[StrictInt] = None
    # the room token (router: secrets.token_urlsafe(24); choice i derives its own, docs/pd.md "KV plane
    # authentication"); bounded, never shown
    bootstrap_token: Optional[StrictStr] = Field(default=None, max_length=128, repr=False)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None
    response_format: Optional[ResponseFormat] = None
    kvship_resume: Optional[ResumeInfo] = None


class GenerateSamplingParams(BaseModel):
    """``sampling_params`` of /generate (SGLang names)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: Optional[StrictInt] = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    seed: Optional[StrictInt] = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    n: StrictInt = 1
    # structured output (at most one): a JSON schema as a string, a regex, an EBNF grammar
    json_schema: Optional[StrictStr] = None
    regex: Optional[StrictStr] = None
    ebnf: Optional[StrictStr] = None


class GenerateReqInput(BaseModel):
    """/generate body: exactly one of ``text`` / ``input_ids``, single or batch."""

    text: Union[StrictStr, list[StrictStr], None] = None
    input_ids: Union[list[StrictInt], list[list[StrictInt]], None] = None
    sampling_params: Union[GenerateSamplingParams, list[GenerateSamplingParams], None] = None
    stream: StrictBool = False
    return_logprob: Union[StrictBool, list[StrictBool]] = False
    top_logprobs_num: StrictInt = 0
    return_text_in_logprobs: StrictBool = False
    logprob_start_len: Optional[StrictInt] = None
    rid: Union[StrictStr, list[StrictStr], None] = None
    # PD disaggregation (filled in by the router)
    bootstrap_host: Union[StrictStr, list[StrictStr], None] = None
    bootstrap_port: Union[StrictInt, list[StrictInt], None] = None
    bootstrap_room: Union[StrictInt, list[StrictInt], None] = None
    bootstrap_token: Union[StrictStr, list[StrictStr], None] = Field(default=None, repr=False)
    # PD latency trace in ``meta_info.trace`` (docs/pd.md, "Reading a request's trace")
    return_trace: StrictBool = False
    kvship_resume: Optional[ResumeInfo] = None


class AbortRequest(BaseModel):
    rid: StrictStr


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    # kvship extension, present only on speculative workers: ``kvship_spec_accept_length`` (tokens per verify
    # round, averaged over the response's choices; docs/speculative.md)
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    """``reasoning_content`` and ``tool_calls`` appear only when set (docs/api.md, "Tool calling", "Reasoning")."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict:
        out = handler(self)
        for k in ("reasoning_content", "tool_calls"):
            if out.get(k) is None:
                out.pop(k, None)
        return out


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvship"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
