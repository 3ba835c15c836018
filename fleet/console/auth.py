"""Console login and logout: Django's own auth views with the console's template."""

from django.contrib.auth import views as auth_views

login = auth_views.LoginView.as_view(
    template_name="console/login.html", redirect_authenticated_user=True
)
# Django's LogoutView accepts POST only, so a link prefetch can never log an operator out.
logout = auth_views.LogoutView.as_view(next_page="console:login")
