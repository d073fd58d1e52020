"""`python -m qarl.cli ...` is `qarl ...`."""

from qarl.cli import main

raise SystemExit(main())
