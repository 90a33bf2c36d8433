"""An agent framework nobody here wrote, unchanged, against ``pipeline serve`` of the tiny build's published bundle:
pydantic-ai's ``Agent`` with a structured output type (which it asks for as a tool call it requires, and validates
with pydantic) and a function tool it may call first. On the random tiny model only the guided decoding of the
required tool call can make the agent's answer valid."""
from __future__ import annotations

from typing import Literal

import pytest

from tests.helpers.serving import Serve

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "tiny-qwen3"


def test_a_pydantic_ai_agent_gets_its_structured_output_and_its_tool_calls_are_valid(tiny_build, tmp_path_factory):
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    class City(BaseModel):
        name: Literal["Paris", "Lyon", "Nice"]
        population: int = Field(ge=0, le=999)

    bundle = next(tiny_build.glob("published/**/bundle.json")).parent
    with Serve(bundle, "serve.openai.port=0", cwd=tmp_path_factory.mktemp("agent-serve")) as served:
        try:
            model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=served.url, api_key="none"))
            settings = {"temperature": 0, "max_tokens": 200}
            out = Agent(model, output_type=City, model_settings=settings).run_sync(
                "Describe a French city.", usage_limits=UsageLimits(request_limit=3))
            assert isinstance(out.output, City) and out.usage.requests == 1

            looked_up: list[str] = []
            agent = Agent(model, output_type=City, model_settings=settings)

            @agent.tool_plain
            def lookup(city: Literal["Paris", "Lyon"]) -> str:
                """Look a city up."""
                looked_up.append(city)
                return f"{city}: about 2 million people"

            out = agent.run_sync("Look Paris up, then describe it.", usage_limits=UsageLimits(request_limit=6))
            assert isinstance(out.output, City)
            assert all(c in ("Paris", "Lyon") for c in looked_up)  # a tool call the model made had valid arguments
        finally:
            assert served.stop() == 0
