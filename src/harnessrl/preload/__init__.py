"""Modules a fork server imports once before it forks attempts (`controller.preload`): each imports an
SDK and warms its first requests, so every forked harness starts with them done (`openai`)."""
