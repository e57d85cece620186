"""OpenAI-compatible request bodies (pydantic) and their translation to ``SamplingParams``.

Standard fields follow the OpenAI API; the vLLM-compatible extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``return_token_ids``, ``priority``) and pdserve's SLO fields
(``slo_class``, ``slo_ttft_ms``, ``slo_tpot_ms``) arrive as top-level JSON
fields (the ``openai`` client's ``extra_body``). Structured output (``response_format``, the
``guided_*`` extras, ``structured_outputs``, chat's ``tools`` / ``tool_choice``) is bounded here
in size and shape and turned into one ``Constraint`` by ``router/structured_api.py``.
Unknown fields are ignored, as OpenAI does.
Sampling fields left unset (absent or null) take the model's generation defaults, then
pdserve's (``model_runtime/generation_config.py``). Range checks live in one place
(``SamplingParams.validate`` via the router), so the HTTP and gRPC APIs reject exactly the same
requests with the same messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pdserve.model_runtime.generation_config import NO_DEFAULTS, GenerationDefaults
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.structured.constraint import MAX_CHOICES, MAX_REGEX_CHARS, MAX_SPEC_BYTES
from pdserve.router.chat import ROLES
from pdserve.router.config import Caps
from pdserve.router.errors import Code, RouterError
from pdserve.router.slo import SloHint


def _json_integer(value: Any) -> Any:
    """JSON's integers as JSON Schema counts them: 3 and 3.0, but never true or "3" (the models
    are strict: no other coercion)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_json_integer)]
DEFAULT = SamplingParams()  # every unset field means what it means to the engine
TokenIds = Annotated[list[Int], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
NON_EMPTY = Field(min_length=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


# -- structured output ----------------------------------------------------------------------
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 4096
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
Schema = dict[str, Any]  # a JSON Schema; its size and depth are ``check_constraint``'s to bound
Regex = Annotated[str, Field(max_length=MAX_REGEX_CHARS)]
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_SPEC_BYTES)]], Field(max_length=MAX_CHOICES)]
GrammarText = Annotated[str, Field(max_length=MAX_SPEC_BYTES)]
JsonText = Annotated[str, Field(max_length=MAX_SPEC_BYTES)]  # a schema sent as JSON text


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: Schema | bool | None = Field(None, alias="schema", description="unset: any JSON object")
    strict: bool | None = Field(None, description="ignored: the schema is always enforced")


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: at most one of its fields."""

    model_config = ConfigDict(strict=True)

    json_: Schema | JsonText | None = Field(None, alias="json")
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(pattern=TOOL_NAME, max_length=64)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: Schema | None = Field(None, description='unset: {"type": "object", "properties": {}}')
    strict: bool | None = Field(None, description="ignored: the parameters are always enforced")


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(max_length=64)
    arguments: str


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (multi-turn tool use)."""

    model_config = ConfigDict(strict=True)

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str
    max_tokens: Int | None = Field(None, description="tokens to generate (server default when unset)")
    temperature: float | None = Field(
        None, description=f"unset: the model's default, else {DEFAULT.temperature}"
    )
    top_p: float | None = Field(None, description=f"unset: the model's default, else {DEFAULT.top_p}")
    n: Int = Field(1, description="sequences per prompt (capped by the server)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Int | None = None
    presence_penalty: float = DEFAULT.presence_penalty
    frequency_penalty: float = DEFAULT.frequency_penalty
    user: str | None = None
    # vLLM-compatible extensions
    top_k: Int | None = Field(None, description=f"unset: the model's default, else {DEFAULT.top_k}")
    min_p: float | None = Field(None, description=f"unset: the model's default, else {DEFAULT.min_p}")
    repetition_penalty: float | None = Field(
        None, description=f"unset: the model's default, else {DEFAULT.repetition_penalty}"
    )
    ignore_eos: bool = DEFAULT.ignore_eos
    min_tokens: Int = DEFAULT.min_tokens
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = DEFAULT.include_stop_str_in_output
    return_token_ids: bool = Field(False, description="add prompt and completion token ids to choices")
    # int32, as the gRPC API carries it
    priority: Int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower is served first")
    slo_class: str = Field("", max_length=64, description="SLO class configured on the server ('': default)")
    slo_ttft_ms: float = Field(0.0, ge=0, description="this request's TTFT target (0: its class's)")
    slo_tpot_ms: float = Field(0.0, ge=0, description="this request's TPOT target (0: its class's)")
    # structured output (at most one constraint per request; router/structured_api.py)
    response_format: ResponseFormat | None = None
    guided_json: Schema | JsonText | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    structured_outputs: StructuredOutputs | None = None

    def slo_hint(self) -> SloHint:
        return SloHint(self.slo_ttft_ms, self.slo_tpot_ms, self.priority, self.slo_class)

    def sampling_params(
        self,
        caps: Caps,
        max_tokens: Int | None,
        logprobs: int | None,
        defaults: GenerationDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        if not 1 <= self.n <= caps.max_n:
            raise RouterError(
                Code.INVALID_ARGUMENT, f"n: must be in [1, {caps.max_n}] (server cap), got {self.n}", "n"
            )
        fields = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        return SamplingParams.create(
            **caps.with_defaults(defaults, fields, max_tokens),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: (
        Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], NON_EMPTY]
    )
    logprobs: Int | None = Field(None, description="top alternatives per token (0: chosen token only)")
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RouterError(Code.INVALID_ARGUMENT, "prompt: must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True)

    role: str = Field(json_schema_extra={"enum": list(ROLES)})  # checked with the template's message
    content: str | list[TextPart] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='unset: "auto" with tools (refused: no tool-call parser), else "none"'
    )

    def requested_max_tokens(self) -> int | None:
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            msg = "max_tokens: differs from max_completion_tokens; send one"
            raise RouterError(Code.INVALID_ARGUMENT, msg, "max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise RouterError(Code.INVALID_ARGUMENT, "top_logprobs: needs logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0
