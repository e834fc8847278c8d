// Chart.js with only the parts the page uses registered (keeps the bundle small).
import { Chart, CategoryScale, Legend, LinearScale, LineController, LineElement, LogarithmicScale, PointElement, ScatterController, Tooltip } from 'chart.js';

Chart.register(CategoryScale, Legend, LinearScale, LineController, LineElement, LogarithmicScale, PointElement, ScatterController, Tooltip);

export { Chart };

/** One color per prompt (or series), distinguishable on white. */
export const PALETTE = ['#2f5fd0', '#d9480f', '#2b8a3e', '#9c36b5', '#e8590c', '#0b7285', '#c2255c', '#5c940d'];
