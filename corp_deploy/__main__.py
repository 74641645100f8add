"""``python -m corp_deploy`` (also what ``torchrun -m corp_deploy`` runs)."""

from corp_deploy.cli import main

if __name__ == "__main__":
    main()
