"""MLflow's tracking server as ``grpo ui`` runs it (``mlflow server --app-name grpo``): MLflow's own app, whose pages
open an experiment on its runs ("Model training") view.

MLflow 3.17's UI chooses an experiment's view from the link's ``workflowType`` or, without one, from what the
browser chose last (localStorage ``mlflow.workflowType_v1``), and a browser that never chose opens the GenAI overview:
every experiment reached from MLflow's own experiment list did. The platform's links carry the parameter
(:func:`grpo.tracking.store.mlflow_ui_url`); this app also makes "Model training" the default of a browser that has
not chosen yet, by adding one line of script to the page MLflow serves. A person's own choice in the sidebar is kept.
MLflow's ``mlflow.app`` entry-point group is how the server loads it (``pyproject.toml``).

``grpo team up`` serves this app behind MLflow's basic-auth app (``--app-name grpo-auth``,
:func:`create_auth_app`): MLflow's ``basic-auth`` entry point wraps MLflow's bare Flask app, so it would drop the
default view above.
"""

from __future__ import annotations

from mlflow.server import app as flask_app
from mlflow.server.fastapi_app import app  # noqa: F401  what uvicorn serves: MLflow's FastAPI app over flask_app

STORAGE_KEY = "mlflow.workflowType_v1"
DEFAULT_VIEW = "machine_learning"
_SCRIPT = (f'<script>try{{if(!localStorage.getItem("{STORAGE_KEY}"))localStorage.setItem("{STORAGE_KEY}",'
           f'JSON.stringify("{DEFAULT_VIEW}"))}}catch(e){{}}</script>').encode()


@flask_app.after_request
def _runs_view_by_default(response):
    """MLflow's index.html with the default view set before its scripts run."""
    if response.mimetype == "text/html" and response.status_code == 200:
        response.direct_passthrough = False
        body = response.get_data()
        if b"<head>" in body and _SCRIPT not in body:
            response.set_data(body.replace(b"<head>", b"<head>" + _SCRIPT, 1))
    return response


def create_auth_app():
    """This app behind MLflow's basic-auth (users, permissions, 401 without credentials): MLflow's ``create_app``
    adds its hooks to the same Flask app this module added the default view to, and returns the FastAPI app over it.
    A factory (uvicorn ``--factory``): the auth store is opened in the server's worker, not at import."""
    from mlflow.server.auth import create_app

    return create_app(flask_app)
