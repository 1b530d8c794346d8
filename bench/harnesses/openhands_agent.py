"""The OpenHands SDK's default agent (terminal, file editor, task tracker; no browser) on one task, as
an application built on the SDK would run it. Runs in the SDK's own venv (Python >= 3.12, see
setup.sh). The model endpoint comes from LLM_MODEL, LLM_BASE_URL and LLM_API_KEY; the agent works in
the current directory; the final response is printed.

    LLM_MODEL=openai/smollm2 LLM_BASE_URL=http://127.0.0.1:8000/v1 LLM_API_KEY=... python openhands_agent.py "task"
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    """Run the task given as the first argument; print the agent's final response."""
    from openhands.sdk import LLM, Conversation
    from openhands.sdk.conversation.response_utils import get_agent_final_response
    from openhands.tools.preset.default import get_default_agent

    llm = LLM(model=os.environ["LLM_MODEL"], base_url=os.environ["LLM_BASE_URL"],
              api_key=os.environ["LLM_API_KEY"], usage_id="agent")  # fmt: skip
    agent = get_default_agent(llm=llm, cli_mode=True)
    conversation = Conversation(agent=agent, workspace=os.getcwd(), max_iteration_per_run=20)
    conversation.send_message(sys.argv[1])
    conversation.run()
    print(get_agent_final_response(conversation.state.events))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
