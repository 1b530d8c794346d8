"""harnessrl: harnessed agentic RL — train the model behind an unmodified agent harness."""

__version__ = "0.1.0"
