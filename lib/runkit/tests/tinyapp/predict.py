"""``python -m tinyapp.predict ckpt_path=...``: the template's predict.py (in eval.py)."""

from tinyapp.eval import predict_main as main

if __name__ == "__main__":
    main()
