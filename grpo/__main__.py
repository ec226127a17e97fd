"""``python -m grpo ...`` is the ``grpo`` command (what ``torchrun -m grpo run`` / ``accelerate launch -m grpo``
run)."""

from grpo.app.cli import main

if __name__ == "__main__":
    main()
