"""Agent tenants (issue 51): the parts that let an RL tenant's rollouts be multi-turn conversations
with tools, run by an environment and captured token for token at the job's own endpoint.

The package holds ``chat`` (OpenAI messages to a chat template's tokens, turn by turn and
append-only, Hermes tool calls parsed back out), ``ledger`` (one trajectory's tokens, segments and
messages), ``endpoint`` (the job-private ``/v1`` routes) and ``envs`` (the environments). Nothing is
imported here, so that importing one part never pulls in the others' dependencies.
"""
