"""An agent loop over ``kvexport serve``'s OpenAI API: one Python function as a tool, called until the model answers.

    kvexport serve out/qwen2.5 --enable-auto-tool-choice &
    python examples/agent_tools.py --base-url http://127.0.0.1:8000/v1 "What is the weather in Paris?"

The model is offered ``get_weather``. Each call it makes is run here and its result goes
back as a ``tool`` message; the loop ends when the model answers in text, or after
``--turns`` rounds. ``--first-choice required`` makes the first turn a call (the server's
grammar enforces it, so the arguments always parse and fit the schema); later turns are
``auto``: the model decides, and the server's tool-call parser reads what it wrote. Only the
``openai`` package is needed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    """The tool itself: a made-up forecast (a real agent would call a weather service here)."""
    degrees = 18 if unit == "celsius" else 64
    return {"city": city, "temperature": degrees, "unit": unit, "sky": "clear"}


def run(
    client: OpenAI,
    model: str,
    question: str,
    *,
    first_choice: str = "auto",
    turns: int = 4,
    max_tokens: int = 64,
    temperature: float = 0.0,
) -> list[dict[str, Any]]:
    """The conversation, ending with the model's text answer (or after ``turns`` rounds): OpenAI's message dicts."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for turn in range(turns):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice=first_choice if turn == 0 else "auto",  # type: ignore[arg-type]
            parallel_tool_calls=False,  # one call a turn: its result comes back before the next
            max_tokens=max_tokens,
            temperature=temperature,
        )
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append({
            "role": "assistant",
            "content": message.content,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in calls],  # type: ignore[union-attr]
        })
        if not calls:
            break
        for call in calls:
            result = get_weather(**json.loads(call.function.arguments))  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return messages


def main() -> None:
    """Run the loop once and print each step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="the served model's name [default: the server's first]")
    parser.add_argument("--first-choice", default="auto", choices=["auto", "required"])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0)
    model = args.model or client.models.list().data[0].id
    conversation = run(
        client, model, args.question, first_choice=args.first_choice, turns=args.turns, max_tokens=args.max_tokens,
        temperature=args.temperature,
    )
    for message in conversation[1:]:
        if message["role"] == "tool":
            print(f"tool result: {message['content']}")
        for call in message.get("tool_calls") or ():
            print(f"call: {call['function']['name']}({call['function']['arguments']})")
        if message["role"] == "assistant" and not message.get("tool_calls"):
            print(f"answer: {message['content']}")


if __name__ == "__main__":
    main()
