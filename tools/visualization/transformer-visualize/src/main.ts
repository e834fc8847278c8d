import { createApp } from 'vue';
import { createPinia } from 'pinia';
import App from './App.vue';
import { useConnectionStore } from './stores/connection';
import { wireStores } from './stores/wiring';
import './style.css';

const pinia = createPinia();
const app = createApp(App).use(pinia);
wireStores(pinia);
app.mount('#app');
const connection = useConnectionStore(pinia);
if (connection.connectAtOnce) connection.connect();
